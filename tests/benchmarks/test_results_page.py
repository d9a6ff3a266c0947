"""docs/BENCHMARKS.md is generated from docs/results/*.json: the page is never stale, every result
says how to reproduce it and where it ran, and a malformed results file is refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import results_page  # noqa: E402


def test_the_page_is_what_the_results_generate() -> None:
    assert results_page.main(["--check"]) == 0, "run: python benchmarks/results_page.py"


def test_every_result_names_its_machine_date_and_commands() -> None:
    results = results_page.load_all()
    assert results, "no results in docs/results"
    for r in results:
        assert r.commands and r.date[:4].isdigit() and r.date[4] == "-", r.name
        # A CPU result names the CPU and whether it has AMX: the two machine kinds differ by 2x.
        if r.machine != "none":
            assert ("Intel" in r.machine or "AMD" in r.machine) and "AMX" in r.machine.upper(), r.name
    page = results_page.PAGE.read_text()
    for r in results:
        assert f"## {r.question}" in page and r.answer in page


def _write(folder: Path, **change: object) -> Path:
    good = json.loads(next(results_page.RESULTS.glob("*.json")).read_text())
    good.update(change)
    path = folder / "9-broken.json"
    path.write_text(json.dumps(good))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"commands": []}, "no command"),
        ({"plots": ["compare/nowhere.svg"]}, "docs/compare/nowhere.svg does not exist"),
        ({"table": {"columns": ["a", "b"], "rows": [["1"]]}}, "does not have the table's 2 columns"),
    ],
)
def test_a_malformed_result_is_refused_by_name(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    with pytest.raises(results_page.ResultError, match=f"9-broken.json: .*{message}"):
        results_page.load(_write(tmp_path, **change))


def test_a_missing_field_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path)
    raw = json.loads(path.read_text())
    del raw["machine"], raw["date"]
    path.write_text(json.dumps(raw))
    with pytest.raises(results_page.ResultError, match="missing machine, date"):
        results_page.load(path)
