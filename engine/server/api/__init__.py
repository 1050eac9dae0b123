"""The FastAPI app an API process serves: its routes, the bounds on one request, and a guide's admission."""
