"""``python -m dtorch_core`` is the ``dtorch`` command."""

from .cli import main

raise SystemExit(main())
