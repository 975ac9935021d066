"""`python -m molt.export`: the command; its code is molt/driver/export.py."""

from molt.driver.export import main

if __name__ == "__main__":
    main()
