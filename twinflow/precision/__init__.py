"""The compact state's formats: 8-bit moments and 24-bit masters, their torch reference, and Adam over them as
float32 torch operations (the kernel's bits)."""
