"""The HTTP process: FastAPI app factory, request schemas, OpenAI/native/ops routes, auth, and
the tokenizer manager that talks to the scheduler process."""
