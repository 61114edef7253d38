"""pd-cluster: disaggregated prefill/decode serving for Llama-family models."""
