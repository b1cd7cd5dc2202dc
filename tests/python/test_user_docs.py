"""The user-facing text can be trusted: a license, figures in the README that are the latest ones of
docs/benchmarks.md (and describe what initialize does: the E4M3 weight copy included), and no
wording about how the project is developed."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = " ".join((ROOT / "README.md").read_text().split())  # one space between words: lines wrap anywhere
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()


def table_row(text: str, first_cell: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_license_is_apache_2_in_both_places():
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the whole text, not a pointer to it
    assert re.search(r'^license = "Apache-2.0"$', (ROOT / "pyproject.toml").read_text(), re.M)


def test_the_readme_quotes_the_optimizer_row_with_the_e4m3_copy():
    row = table_row(BENCHMARKS, "fp8amp O2 + E4M3 weight copy")
    ms, ratio, state_bytes = row[1], row[2], row[7]
    assert state_bytes == "7.00" and ratio.endswith("×")
    assert re.search(rf"\*\*{re.escape(ratio)} `torch\.optim\.AdamW\(fused=True\)`\*\* \({ms} vs", README), ratio
    assert "**7.0 bytes of model state per Linear parameter**" in README
    assert "7 bytes of model state per Linear parameter" in README and "6 bytes" not in README


def test_the_readme_quotes_the_latest_gemm_table():
    section = BENCHMARKS[BENCHMARKS.index("## FP8 GEMM"):BENCHMARKS.index("## Fp8Linear")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if re.match(r"\| \d", line) and not line.startswith("| 1024³")]
    vs_scaled_mm = sorted(float(r[2].rstrip("×")) for r in rows)
    vs_bf16 = sorted(float(r[3].rstrip("×")) for r in rows)
    assert f"{vs_scaled_mm[0]:.2f}–{vs_scaled_mm[-1]:.2f}× its speed" in README
    assert f"{vs_bf16[0]:.2f}–{vs_bf16[-1]:.2f}× BF16" in README
    assert f"at 8192³ {table_row(section, '8192³')[1]} TFLOP/s in the sweep" in README
    for stale in ("1.29 PFLOP/s", "1.30 PFLOP/s", "1.26 PFLOP/s"):  # older runs, quoted elsewhere before
        assert stale not in README and stale not in (ROOT / "docs" / "gemm.md").read_text()


def test_no_text_about_how_the_project_is_developed():
    pattern = re.compile(r"\bsessions?\b|device call|carry list|device budget", re.I)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {p.name: m for p in pages if (m := pattern.findall(p.read_text()))}
    assert not found, found
