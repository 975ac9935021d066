"""`python -m molt.inspect`: the command; its code is molt/driver/inspect.py (the page: inspect.html)."""

import sys

from molt.driver.inspect import main

if __name__ == "__main__":
    sys.exit(main())
