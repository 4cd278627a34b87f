// Reference of the vector-add task: inputs and the expected output, on the host.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

inline void generate_input(int size, std::uint64_t seed, std::vector<float>& a, std::vector<float>& b) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    a.resize(size);
    b.resize(size);
    for (int i = 0; i < size; ++i) {
        a[i] = dist(rng);
        b[i] = dist(rng);
    }
}

inline std::vector<float> ref_kernel(const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<float> c(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) c[i] = a[i] + b[i];
    return c;
}
