"""`python -m molt.tinker serve [--host H] [--port P] [overrides]`: the Tinker API over Molt's engines and
trainer ranks (molt/tinker/serve.py)."""

import sys

from molt.tinker.serve import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python -m molt.tinker serve [--host H] [--port P] [key=value ...]")
    main(sys.argv[2:])
