"""`python -m datacat`: the datacat command."""

from datacat.cli import main

main()
