"""specdec inference engine: model, paged KV cache, scheduler, runner, sampler, loop, CLI."""
