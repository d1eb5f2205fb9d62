"""Load-testing harness: `specdec bench serve|sweep|peer` (see serve.py for the metrics)."""
