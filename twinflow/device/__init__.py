"""The device side's state and step: fp32 state with torch's fused Adam, and the compact state with its compiled
step."""
