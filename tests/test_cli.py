"""The command line: generated from the config dataclasses (every flag has help, enumerated fields
show their choices), `python -m qkvlab`, --print-config, `info` on folders, bad values refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qkvlab.base.settings import resumable_fields
from qkvlab.cli import COMMANDS, build_parser, main
from qkvlab.train.config import RESUMABLE_FIELDS, TrainConfig


def test_python_dash_m_qkvlab_runs_the_command():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-m", "qkvlab", "--help"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "compare" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "qkvlab", "info", "--preset", "tiny", "--json"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and json.loads(out.stdout)["n_layer"] == 2


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_has_help_and_enumerations_show_choices(command):
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings[0]} has no help"
    dtype = [a for a in sub._actions if "--dtype" in a.option_strings]
    assert all(a.choices for a in dtype)


def test_resumable_fields_come_from_the_metadata():
    assert RESUMABLE_FIELDS == resumable_fields(TrainConfig)
    assert {"max_steps", "eval_every", "device", "sharding"} <= set(RESUMABLE_FIELDS)
    assert not {"lr", "seed", "weight_decay", "model", "batch_size"} & set(RESUMABLE_FIELDS)


def test_paper_a_size_baselines_in_info(capsys):
    """Paper A at GPT-2 small: original_smaller_mlp 77.88M, original_smaller_overall 79.73M non-embedding."""
    for variant, expected in (("Q-K-V/mlp=Id-K-V", 77.88), ("Q-K-V/width=Id-K-V", 79.73)):
        assert main(["info", "--preset", "gpt2-124m", "--variant", variant, "--json"]) == 0
        body = json.loads(capsys.readouterr().out)
        assert round(body["params_non_embedding"] / 1e6, 2) == expected
    assert main(["info", "--preset", "gpt2-124m", "--variant", "Q-K-V/width=Id-K-V", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert (body["d_model"], body["d_head"], body["mlp_hidden"]) == (744, 62, 4 * 744)


def test_info_reads_a_model_or_run_folder(tmp_path, capsys):
    assert main(["init", "--out", str(tmp_path / "m"), "--preset", "tiny", "--attn", "Q-K=V"]) == 0
    capsys.readouterr()
    assert main(["info", "--preset", "tiny", "--attn", "Q-K=V", "--json"]) == 0
    expected = capsys.readouterr().out
    assert main(["info", str(tmp_path / "m"), "--json"]) == 0
    assert capsys.readouterr().out == expected
    run = tmp_path / "run"  # a run still training: only checkpoint/ holds a config
    (tmp_path / "m").rename(tmp_path / "checkpoint")
    run.mkdir()
    (tmp_path / "checkpoint").rename(run / "checkpoint")
    assert main(["info", str(run), "--json"]) == 0
    assert capsys.readouterr().out == expected
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "no such model folder" in capsys.readouterr().err


def test_train_print_config_resolves_the_identity_weight_decay(capsys):
    assert main(["train", "--preset", "tiny", "--attn", "Id-K=V", "--print-config", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["weight_decay"] == 0.03125 and body["model"]["attn"] == "Id-K=V"
    assert main(["train", "--preset", "tiny", "--print-config", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_decay"] == 0.1
    assert main(["train", "--preset", "tiny", "--attn", "Id-K-V", "--weight-decay", "0.2", "--print-config"]) == 0
    assert "weight_decay: 0.2" in capsys.readouterr().out
    # an old run's config (explicit 0.1 on an identity scheme) still loads as it was
    old = TrainConfig.from_dict({**body, "model": {**body["model"], "attn": "Id-K-V"}, "weight_decay": 0.1})
    assert old.weight_decay == 0.1


def test_print_config_round_trips_through_a_config_file(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--attn", "Q-K=V", "--lr", "0.01", "--print-config"]) == 0
    (tmp_path / "c.yaml").write_text(capsys.readouterr().out)
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--print-config", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert (body["lr"], body["model"]["attn"], body["model"]["n_layer"]) == (0.01, "Q-K=V", 2)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["info", "--attn-scale", "inf"], "'inf' must be a finite number"),
        (["info", "--dropout", "nan"], "finite"),
        (["info", "--attn", " "], "empty"),
        (["train", "--preset", "tiny", "--out", ""], "empty"),
        (["train", "--preset", "tiny", "--lr", "inf", "--print-config"], "finite"),
        (["bench", "--variants", "Q-K=V:mqa", "--print-config"], "Q-K=V/MQA"),
        (["bench", "--decode-batches", "1,0", "--print-config"], "positive"),
        # a seed beyond torch's signed 64 bits was an overflow traceback in every command that seeds
        (["train", "--preset", "tiny", "--seed", str(2**64), "--print-config"], f"must be <= {2**63 - 1}"),
        (["generate", "m", "--seed", str(2**64), "--print-config"], f"must be <= {2**63 - 1}"),
        (["generate", "m", "--seed", "-5", "--print-config"], "must be >= 0"),
        (["init", "--out", "m", "--seed", str(2**64), "--print-config"], f"must be <= {2**63 - 1}"),
        (["bench", "--seed", "-1", "--print-config"], "must be >= 0"),
        (["retrofit", "m", "--seed", str(2**64), "--print-config"], f"must be <= {2**63 - 1}"),
        # 10**23 seeds (or `--seed 5`, argparse's abbreviation of --seeds) planned for ever
        (["compare", "--seeds", str(10**23), "--dry-run"], "must be <= 10000"),
        (["compare", "--seed", "5", "--dry-run"], "unrecognized arguments: --seed 5"),  # no abbreviations
    ],
)
def test_bad_values_are_one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_model_config_files_for_info_and_init(tmp_path, capsys):
    assert main(["info", "--preset", "tiny", "--attn", "Q-K=V", "--print-config"]) == 0
    (tmp_path / "m.yaml").write_text(capsys.readouterr().out)
    assert main(["info", "--preset", "tiny", "--attn", "Q-K=V", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main(["info", "--config", str(tmp_path / "m.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected
    (tmp_path / "p.toml").write_text('preset = "tiny"\nattn = "Q-K=V"\n')
    assert main(["init", "--config", str(tmp_path / "p.toml"), "--out", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "m"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected
