"""``python -m agile_llmenvs`` runs the command line (as ``accelerate launch -m`` needs)."""

from agile_llmenvs.cli import main

raise SystemExit(main())
