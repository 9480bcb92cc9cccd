"""docs/ARCHITECTURE.md is a map: every product module is named in its folder's section,
and no paragraph runs past ~80 words."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PRODUCT_FOLDERS = ["shared", "services/gateway", "services/tokenizer", "services/scheduler",
                   "services/worker", "services/kvstore", "kernels", "cli", "cli/bench"]
MAX_WORDS = 80


def _sections() -> dict[str, str]:
    """### `folder/` heading → the text under it, up to the next heading."""
    sections, current = {}, None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^#{2,3} `([^`]+)/`", line)
        if heading:
            current = heading.group(1)
            sections[current] = ""
        elif line.startswith("#"):
            current = None
        elif current:
            sections[current] += line + "\n"
    return sections


def test_every_product_module_is_on_the_map():
    sections = _sections()
    missing = []
    for folder in PRODUCT_FOLDERS:
        text = sections.get(folder) or sections.get(folder.split("/")[0], "")
        for module in sorted((ROOT / folder).glob("*.py")):
            if module.name != "__init__.py" and f"`{module.name}`" not in text and f" {module.name}" not in text:
                missing.append(f"{folder}/{module.name}")
    assert not missing, f"not in docs/ARCHITECTURE.md's section for their folder: {missing}"


def _paragraphs(text: str) -> list[str]:
    """Prose blocks: code fences and tables left out; each list item its own paragraph."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    paragraphs, current = [], []
    for line in text.splitlines() + [""]:
        starts_item = re.match(r"^\s*(- |\d+\. )", line)
        if not line.strip() or line.startswith("|") or line.startswith("#") or starts_item:
            if current:
                paragraphs.append(" ".join(current))
            current = [line] if starts_item else []
        else:
            current.append(line)
    return paragraphs


def test_no_paragraph_runs_past_80_words():
    long = [p[:60] for p in _paragraphs(DOC.read_text()) if len(p.split()) > MAX_WORDS]
    assert not long, f"paragraphs over {MAX_WORDS} words: {long}"
