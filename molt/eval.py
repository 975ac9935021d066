"""`python -m molt.eval`: the command; its code is molt/driver/eval.py."""

from molt.driver.eval import main

if __name__ == "__main__":
    main()
