"""Prints the README's two commands, one per line: the fenced bash blocks under its "## Two commands" heading.

CI runs exactly these, so the README and CI cannot drift apart.
"""

import re
import sys
from pathlib import Path

text = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md").read_text()
section = re.search(r"^## Two commands\n(.*?)(?=^## )", text, re.S | re.M)
if section is None:
    sys.exit("README.md has no '## Two commands' section")
blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
if len(blocks) != 2 or any(len(b.strip().splitlines()) != 1 for b in blocks):
    sys.exit(f"README.md's '## Two commands' must hold exactly two one-line bash blocks, found {blocks}")
print("\n".join(b.strip() for b in blocks))
