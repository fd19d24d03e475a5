"""Tool calling for agentic rollouts: the sandbox tools run in, and the tool-call parsing of sampled turns.

* `sandbox.py`: each rollout's tool calls run in a process of their own (working
  directory, wall-clock/CPU/memory/output limits, no network, killed with every
  child at the end); a tool that hangs or crashes ends its turn with a message.
* `parsing.py`: the policy's sampled text becomes tool calls through vLLM's own tool
  parser for the model family, as a vLLM server would parse it.
"""
