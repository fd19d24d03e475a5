"""`moerl plan`: memory, communication and step time of a GLM-5 / Kimi-K2 RL run at scale.

Plain functions over titan_ext's model specs and the rates measured by the benchmarks
(`rates`; copies ship in `measured/`), one module per concern: `model` (parameter counts),
`layout` (the trainer mesh and its checks), `memory`, `comm`, `step_time`, `search`,
`weights` (weight sync to inference), `report` (text and JSON) and `cli` (the `moerl plan`
command). A plan is arithmetic; the model specs come from titan_ext, whose import loads
torch and TorchTitan.
"""
