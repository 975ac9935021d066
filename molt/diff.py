"""`python -m molt.diff`: the command; its code is molt/spec/diff.py."""

import sys

from molt.spec.diff import main

if __name__ == "__main__":
    sys.exit(main())
