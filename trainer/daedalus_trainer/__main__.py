"""`python -m daedalus_trainer ...` is the `daedalus` CLI (the Ray job entrypoint uses this form)."""

from daedalus_trainer.cli import main

raise SystemExit(main())
