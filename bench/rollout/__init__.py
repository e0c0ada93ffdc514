"""The rollout side measured: controller admission, SGLang vs vLLM, pause modes."""
