"""``python -m node``: the ``p2psync`` command (``node.entry``)."""

from node.entry import main

raise SystemExit(main())
