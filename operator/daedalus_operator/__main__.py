"""``python -m daedalus_operator ARGS``: the same as ``daedalus operator ARGS``."""

from daedalus_operator.main import main

raise SystemExit(main())
