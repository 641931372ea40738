"""A folder for PYTHONPATH: only its sitecustomize.py matters (see vllm_launcher.py)."""
