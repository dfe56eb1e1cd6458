"""qkvlab.base.settings: every option comes from a config dataclass; one loader (file + command line +
unknown key); validation generated from the declared types, choices and bounds."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from qkvlab.base import field_types, flag_values, settings, units
from qkvlab.base.errors import UserError
from qkvlab.bench import BenchConfig
from qkvlab.cli import COMMANDS, main
from qkvlab.model.config import ModelConfig
from qkvlab.tasks.lm import LMOptions
from qkvlab.tasks.synthetic import SyntheticOptions
from qkvlab.train.config import TrainConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "qkvlab"


def hand_declared(path: Path) -> list[str]:
    """The options a module declares by hand: add_argument calls with a literal name."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    names = [c.args[0].value for c in calls if getattr(c.func, "attr", "") == "add_argument" and c.args]
    return [n for n in names if isinstance(n, str)]


def test_no_command_declares_an_option_by_hand():
    for name in COMMANDS:
        assert hand_declared(SRC / "commands" / f"{name}.py") == [], name
    assert hand_declared(SRC / "cli.py") == ["--version"]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_takes_config_and_print_config(command):
    from qkvlab.cli import build_parser

    sub = next(a for a in build_parser(command)._actions if a.dest == "command").choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--config", "--print-config"} <= flags


@pytest.mark.parametrize(
    "head,flags",
    [
        (["generate", "m"], ["--prompt", "hi", "--top-k", "5", "--compile"]),
        (["convert", "a", "b"], ["--to", "Id-K-V", "--max-cond", "1e4"]),
        (["similarity", "m"], ["--tokens", "64"]),
        (["prepare"], ["--tokenizer", "char", "--split", "stream"]),
        (["retrofit", "a", "b"], ["--kv-heads", "2", "--layers=-2:"]),
        (
            ["bench"],
            ["--preset", "tiny", "--variants", "Q-K-V,Q-K=V/MQA", "--decode-batches", "1,4", "--context", "32"],
        ),
        (["compare"], ["--task", "reverse", "--task-option", "length=12", "--seeds", "1", "--n-layer", "1"]),
    ],
)
def test_print_config_round_trips_through_a_config_file(head, flags, tmp_path, capsys):
    assert main([*head, *flags, "--print-config", "json"]) == 0
    first = capsys.readouterr().out
    (tmp_path / "c.json").write_text(first)
    assert main([*head, "--config", str(tmp_path / "c.json"), "--print-config", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(first)


def test_load_merges_file_and_command_line_and_refuses_unknown_keys(tmp_path):
    import argparse

    (tmp_path / "b.yaml").write_text("batch: 3\ndecode_batches: [2, 5]\nmodel: {n_layer: 3, context: 64}\n")
    p = argparse.ArgumentParser()
    settings.add_options(p, BenchConfig)
    cfg = settings.load(BenchConfig, tmp_path / "b.yaml", p.parse_args(["--context", "48", "--rounds", "2"]))
    assert (cfg.batch, cfg.decode_batches, cfg.rounds) == (3, (2, 5), 2)
    assert cfg.model == {"n_layer": 3, "context": 48}  # mappings merge key by key, the command line wins
    (tmp_path / "u.yaml").write_text("batchez: 3\n")
    with pytest.raises(UserError, match="unknown bench setting 'batchez'; allowed: batch,"):
        settings.load(BenchConfig, tmp_path / "u.yaml")
    (tmp_path / "t.yaml").write_text("batch: three\n")
    with pytest.raises(UserError, match="batch='three' must be an integer"):
        settings.load(BenchConfig, tmp_path / "t.yaml")


def test_resolve_layers_a_preset_a_file_and_the_command_line():
    """The one resolver: the highest named preset (or whole config) is the base, every mapping
    applies over it in order, whichever layer named the preset."""
    from qkvlab.model.config import preset

    file = {"preset": "tiny", "lr": 0.002, "model": {"attn": "Id-K-V"}}
    cfg = settings.resolve(TrainConfig, {"preset": "small"}, file, {"preset": "small", "model": {"kv_heads": 1}})
    assert (cfg.model.d_model, cfg.lr, cfg.model.attn, cfg.model.kv_heads, cfg.max_steps) == (
        128,
        0.002,
        "Id-K-V",
        1,
        1000,
    )
    assert cfg.replace(model={"preset": "tiny"}).model == preset("tiny")  # a model preset replaces the model whole
    assert cfg.replace(lr=0.1).model == cfg.model and cfg.replace(lr=0.1).lr == 0.1
    # a preset's options are the lm task's: another task starts from its own, the layers' stay
    rev = settings.resolve(TrainConfig, {"preset": "tiny"}, {"task": "reverse", "task_options": {"length": 8}})
    assert rev.task_options == {"length": 8}
    with pytest.raises(UserError, match="r.yaml: unknown train setting 'lrr'; allowed: batch_size"):
        settings.resolve(TrainConfig, {"preset": "tiny"}, {"lrr": 1}, origin="r.yaml")
    with pytest.raises(UserError, match="task 'reverse': n_train=0 must be a positive integer"):
        settings.resolve(TrainConfig, rev, {"task_options": {"n_train": 0}})


def test_task_settings_are_the_tasks_typed_options_and_task_options_stay_the_users():
    """TrainConfig.task_settings: the task's OPTIONS_CLASS, defaults filled, through the task's one
    checker; task_options stays what the user set (the form saved, compared and printed)."""
    rev = TrainConfig.from_dict({"task": "reverse", "task_options": {"length": 8}})
    assert rev.task_settings == SyntheticOptions(length=8)
    assert TrainConfig.from_dict({"preset": "tiny"}).task_settings == LMOptions(tokenizer="bpe:512")
    saved = rev.to_dict()
    assert saved["task_options"] == {"length": 8}
    assert TrainConfig.from_dict(saved).task_options == {"length": 8}
    assert TrainConfig.from_dict(saved).to_dict() == saved


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"lenght": 8}, "task 'reverse': unknown synthetic option 'lenght'; allowed: data_seed, length"),
        ({"length": "abc"}, "task 'reverse': length='abc' must be an integer"),
        ({"length": 0}, "task 'reverse': length=0 must be a positive integer"),
    ],
)
def test_a_bad_task_option_is_one_line_naming_it(options, needle):
    with pytest.raises(UserError) as e:
        TrainConfig.from_dict({"task": "reverse", "task_options": options})
    assert needle in str(e.value) and "\n" not in str(e.value)
    unchecked = dataclasses.replace(TrainConfig(task="reverse"), task_options=options)  # validate() not run
    with pytest.raises(UserError, match=needle.split(";")[0]):
        unchecked.task_settings  # noqa: B018 (the typed view checks on its own)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: ModelConfig(n_layer=0), "n_layer=0 must be a positive integer"),
        (lambda: ModelConfig(n_head=True), "n_head=True must be an integer"),
        (lambda: ModelConfig(norm="batch"), "norm='batch' is not allowed; use one of layernorm"),
        (lambda: ModelConfig(dropout=float("nan")), "dropout=nan must be a finite number"),
        (lambda: ModelConfig(dropout=1.0), "dropout=1.0 must be in [0, 1)"),  # by hand: across the bound
        (lambda: ModelConfig(attn_scale=0.0), "attn_scale=0.0 must be positive"),
        (lambda: ModelConfig(attn=" "), "attn=' ' is empty"),
        (lambda: TrainConfig(lr=float("inf")), "lr=inf must be a finite number"),
        (lambda: TrainConfig(warmup_steps=-1), "warmup_steps=-1 must be >= 0"),
        (lambda: TrainConfig(betas=(0.9,)), "betas=(0.9,) must be a list of 2 values"),
        (lambda: TrainConfig(betas=(0.9, 1.0)), "betas=[0.9, 1.0] must be two numbers in [0, 1)"),
        (lambda: TrainConfig(compile="yes"), "compile='yes' must be true or false"),
        (lambda: TrainConfig(sharding="zero3"), "sharding='zero3' is not allowed"),
        (lambda: BenchConfig(decode_batches=(1, 0)), "decode_batches=(1, 0) must be a positive integer"),
    ],
)
def test_validation_is_generated_from_the_declarations(make, needle):
    with pytest.raises(UserError) as e:
        make().validate()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_every_declared_field_has_a_type_the_generator_knows():
    """A field the command line cannot express must say so (cli=False or a group)."""
    from qkvlab.analysis.similarity import SimilarityConfig
    from qkvlab.compare import CompareConfig
    from qkvlab.convert.config import ConvertConfig
    from qkvlab.data.prepare import PrepareConfig
    from qkvlab.decode.config import GenerateConfig
    from qkvlab.model.config import InitConfig
    from qkvlab.model.info import InfoConfig
    from qkvlab.retrofit.options import RetrofitConfig
    from qkvlab.train.config import TrainRun

    classes = [ModelConfig, TrainConfig, TrainRun, BenchConfig, CompareConfig, InfoConfig, InitConfig]
    classes += [SimilarityConfig, ConvertConfig, RetrofitConfig, PrepareConfig, GenerateConfig]
    for cls in classes:
        hints = field_types.type_hints(cls)
        for f in dataclasses.fields(cls):
            m = f.metadata
            assert m["help"], (cls.__name__, f.name)
            if m["cli"] and m["group"] is None and field_types.base_type(hints[f.name])[0] is not bool:
                assert flag_values.parser_for(hints[f.name], m) is not None, (cls.__name__, f.name)


@pytest.mark.parametrize(
    "text,expected", [("24GB", 24e9), ("80GiB", 80 * 2**30), ("512mb", 512e6), ("1e9", 1e9), ("2TB", 2e12)]
)
def test_byte_sizes(text, expected):
    assert units.byte_size(text, "--memory-budget") == int(expected)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("1e400GB", "not a finite size"),
        ("nanGB", "not a finite size"),
        ("infGB", "not a finite size"),
        ("0GB", "must be positive"),
        ("-1GB", "must be positive"),
        ("24 parsecs", "write a size like"),
    ],
)
def test_bad_byte_sizes_are_one_line(text, needle):
    with pytest.raises(UserError) as e:
        units.byte_size(text, "--memory-budget")
    assert needle in str(e.value) and "--memory-budget" in str(e.value)
