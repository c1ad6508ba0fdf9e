"""`python -m printpress ...` runs the command line."""

from printpress.cli import main

raise SystemExit(main())
