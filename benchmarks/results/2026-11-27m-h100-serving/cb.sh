#!/bin/bash
# does XLA:GPU's command buffer with conditionals (device-side predicates) lift the cond's host wait?
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
demo=(python3 -m jaxsample.serve_demo --bench --requests 128 --slots 32 --max-tokens 64 --spec none)
for flags in "" "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE" "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE --xla_gpu_graph_min_graph_size=1"; do
  echo "XLA_FLAGS=[$flags]"
  XLA_FLAGS="$flags" timeout 80 "${demo[@]}" 2>&1 | grep -v "UserWarning\|warnings.warn" | tail -3
done
