"""`python -m scripts.ab_repository`: see client.ab_repository."""

from client.ab_repository import main

if __name__ == "__main__":
    raise SystemExit(main())
