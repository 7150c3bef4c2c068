"""The Llama-style model of bench/llama_train_bench.py."""
