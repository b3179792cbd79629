"""DLIO 2.0's ``dlio_sampler`` (``dlio_benchmark.data_loader.torch_data_loader``), its code as
it is, for the tests that stand in for DLIO (``test_t1_dlio.py`` runs it as a plain class,
``test_t6_dlio.py`` writes it into a stand-in package read through a mount). It expects
``math``, ``np``, ``Shuffle`` and a ``Sampler`` base class in the namespace it runs in."""

SAMPLER_SRC = '''
class dlio_sampler(Sampler):  # DLIO 2.0's, as it is
    def __init__(self, rank, size, num_samples, shuffle, epochs, seed):
        self.size = size
        self.rank = rank
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.epochs = epochs
        self.seed = seed
        samples_per_proc = int(math.ceil(num_samples/size))
        start_sample = self.rank * samples_per_proc
        end_sample = (self.rank + 1) * samples_per_proc
        self.indices = list(range(start_sample, end_sample))

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        if self.shuffle != Shuffle.OFF:
            if self.shuffle == Shuffle.SEED:
                np.random.seed(self.seed)
            np.random.shuffle(self.indices)
        for sample in self.indices:
            yield sample
'''
