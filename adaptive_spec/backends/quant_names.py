"""Each engine's quantization names, in one stdlib-only place: engines.py offers them, params.py types them,
and the engines' modules implement them."""
# torch's weight-only draft quantizations (backends/cpu/quant.py makes the layers)
TORCH_DRAFT_QUANTS = ("int8", "int4")
# llama.cpp's re-quantizations of a GGUF file (llamacpp_pair.requantized_gguf): name -> (llama.cpp file type, the
# one tensor type of every matrix or None). Without a type llama.cpp mixes types as its file type says (the
# output matrix stays Q6_K); a "-pure" one puts every matrix, the output and the embedding included, in that
# one type (`pure` plus output_tensor_type / token_embedding_type).
GGUF_QUANTS = {
    "q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", None),
    "q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", None),
    "q4_0-pure": ("LLAMA_FTYPE_MOSTLY_Q4_0", "GGML_TYPE_Q4_0"),
    "q4_k-pure": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", "GGML_TYPE_Q4_K"),
    "iq4_nl-pure": ("LLAMA_FTYPE_MOSTLY_IQ4_NL", "GGML_TYPE_IQ4_NL"),
}
