"""Offloading: the device backend (the only module that touches torch.cuda), the weight pager,
the CGOPipe pipeline, Twiddler expert placement, routing profiles and the timeline trace.
`build` assembles them around a model runner from the engine's knobs."""
