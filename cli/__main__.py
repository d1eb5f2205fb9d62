"""`python -m cli ...` = `specdec ...` (how the launcher and the tests start services)."""

from cli import console

console()
