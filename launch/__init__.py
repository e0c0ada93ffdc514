"""Launch: config -> allocation plan -> rendered sbatch -> submission, and the local launcher
that runs every role on one machine. Rendering and planning are pure functions.
"""
