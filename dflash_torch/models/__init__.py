"""Model families (one file per family, layers named after the HF checkpoint keys) and what they are built of:
layers, rotary tables, the static KV cache, experts, quantized linear layers, the flat decode pieces, CUDA graphs."""
