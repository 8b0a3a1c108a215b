"""The optimizers users hold: TwinFlowAdam's face, ``opt.state``, the hooks of ``attach()``,
``offload_states()``, and CPUAdam."""
