"""The paper's tables and figures, one module each: `python -m experiments.<name> --profile ...`
(shared machinery in experiments/_common.py; `python -m experiments.reproduce` runs several)."""
