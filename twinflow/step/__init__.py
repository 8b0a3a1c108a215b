"""One optimizer step across both sides: the split of the parameters, the order of a step, the gradients
``attach()`` notes, unscaling and clipping, and when to speculate."""
