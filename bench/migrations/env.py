from gpusched.infra.migrations import run_env

run_env()
