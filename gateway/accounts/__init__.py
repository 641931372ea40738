"""The shared accounts: in flight, breakers, admission and its fair queue, priorities, key and LoRA placement, requests waiting on a first byte."""
