"""The built-in tasks: the arithmetic task (and its calculator tool) and countdown: prompts,
worked answers and the answer each verifier checks. Their committed warm-start models are in
models/, the builders that made them in warm_start/ (which sits above the roles: it trains).
"""
