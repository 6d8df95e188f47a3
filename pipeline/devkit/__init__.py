"""The development kit: synthetic scenes and the tiny T5 and Qwen2-VL that the demo, tests and benchmarks build."""
