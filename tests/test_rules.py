"""The analysis rules' version (analysis/rules.py): a changed rule or margin needs a new version and a
changelog entry; the changelog is dated and ordered; unknown versions are one-line errors."""

import pytest

from qkvlab.analysis import rules
from qkvlab.base.errors import UserError


def test_current_rules_match_their_pinned_fingerprint():
    """Change a margin, a claim, a constant or a switch, and this fails until ANALYSIS_VERSION is
    bumped with a CHANGELOG entry (and its new fingerprint) saying what changed after which runs."""
    last = rules.CHANGELOG[-1]
    assert last.version == rules.ANALYSIS_VERSION == rules.CURRENT.version
    assert rules.fingerprint() == last.fingerprint


def test_changelog_is_ordered_and_says_what_came_before():
    versions = [c.version for c in rules.CHANGELOG]
    assert versions == sorted(versions) == list(range(1, rules.ANALYSIS_VERSION + 1))
    assert all(c.date and c.commit and c.what and c.data_before for c in rules.CHANGELOG)
    assert set(rules.VERSIONS) <= set(versions)


def test_provenance_says_which_rules_came_after_the_data():
    lines = rules.provenance_lines(4, 2)
    assert "version 4" in lines[0] and "under version 2" in lines[1]
    assert "v3 (2026-12-01 11:15)" in lines[1] and "v4" in lines[1]
    assert len(rules.provenance_lines(4, 4)) == 1
    assert "not recorded" in rules.provenance_lines(4, None)[1]


def test_unknown_version_is_a_one_line_error():
    with pytest.raises(UserError, match="analysis version 9"):
        rules.rules(9)
    assert rules.rules() is rules.CURRENT


def test_docs_tell_the_changelog():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "analysis.md").read_text()
    assert rules.changelog_markdown() in doc
    assert "fixed before any run" not in doc and "fixed here before any run" not in doc


def test_lm_reconstruction_gives_the_published_version_3_words():
    """scripts/reconstruct_lm_verdicts.py rebuilds the 16-seed LM verdicts from the published
    intervals; under version 3 it must give docs/results/lm/results.md's words claim by claim, and
    under version 2 the 1 / 1 / 5 docs/analysis.md reports."""
    import importlib.util
    import re
    from pathlib import Path

    from qkvlab.analysis import paper_claims as pc

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("reconstruct", root / "scripts" / "reconstruct_lm_verdicts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    md = (root / "docs" / "results" / "lm" / "results.md").read_text()
    published = {}
    for c in (c for c in pc.LM_CLAIMS if c.since <= 3):
        row = next(line for line in md.splitlines() if line.startswith(f"| Paper {c.paper}: {c.text} |"))
        published[c.id] = re.search(r"\*\*(\w+)\*\*", row).group(1)
    assert mod.verdicts(3) == published
    v2 = list(mod.verdicts(2).values())
    assert (v2.count("reproduced"), v2.count("contradicted"), v2.count("inconclusive")) == (1, 1, 5)
    assert mod.verdicts(4)["lm-qkeqv-worst"] == "reproduced"


def test_every_committed_compare_folder_names_its_analysis_version():
    """Each compare.json under docs/results records the analysis version its tables were scored with, a
    version of the changelog, and its results.md states the same one (retrofit's folders are not compares)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    folders = sorted(p.parent for p in results.rglob("compare.json"))
    assert len(folders) >= 20
    known = {c.version for c in rules.CHANGELOG}
    for folder in folders:
        version = json.loads((folder / "compare.json").read_text()).get("analysis_version")
        assert version in known, folder
        assert f"- analysis rules: version {version} (" in (folder / "results.md").read_text(), folder
