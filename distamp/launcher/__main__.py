"""``python -m distamp.launcher``: the same as the ``distrun`` command."""

from distamp.launcher.cli import main

raise SystemExit(main())
