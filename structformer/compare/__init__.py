"""`structformer compare`: one table across the families, every structured model beside its dense baselines,
trained by one recipe on one split with several seeds and timed on one machine (issue 46).

    catalogue  the rows a comparison can hold (ViT, CRATE, SOFT, Sparsifiner, the Mixers, low-rank ViT and WRN), the
               sets (quick, mnist, in1k) and the parameter matching (each row's width chosen for one budget)
    grid       the (model, seed) cells as ordinary run folders: trained, resumed, skipped when finished, refused
               when the recipe changed; Sparsifiner distils from the dense ViT cell of its seed and a pre-trained
               low-rank cell starts from the dense cell's checkpoint at the switch
    speed      FLOPs per image, training and inference images/s timed paired in one process, peak training memory
               in a process per model, and the one-step estimate of a dry run
    record     mean and standard error over seeds, the Pareto fronts, the markdown table, the plots
    report     the timing phase (OUTPUT/speed.json) and the record files (compare.json, leaderboard.md, plots)
    leaderboard  docs/leaderboard.md rendered from a record, with each paper's headline claim checked against it
    in1k       the paper-scale set: one torchrun command per cell and its GPU-hours
    cli        the command line

Nothing here imports torch at module level: `structformer --help` builds the parser.
"""
