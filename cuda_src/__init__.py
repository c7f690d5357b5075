# Makes cuda_src/ installable as the data package ``flasharray.cuda_src``; no Python code lives here.
