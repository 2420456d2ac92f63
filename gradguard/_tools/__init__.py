"""The tools: the gradguard command (bench, doctor, run), the memory meter, the benchmark harness."""
