// POPCORN harness of the vector-add task: `./eval.out <mode> <cases-file>`.
// Results go to the file descriptor in $POPCORN_FD as `key: value` lines. Exit codes: 0 all
// checks passed, 112 a check failed (leaderboard: reported in `check` only), 113 a cases file
// it cannot read, 111 no $POPCORN_FD, 110 a CUDA error, 2 a bad command line.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <regex>
#include <string>
#include <vector>

#include "reference.cuh"
#include "task.h"

namespace {

constexpr int EXIT_CUDA_FAIL = 110;
constexpr int EXIT_PIPE_FAILED = 111;
constexpr int EXIT_VALIDATE_FAIL = 112;
constexpr int EXIT_TEST_SPEC = 113;
constexpr int MIN_RUNS = 3, MAX_RUNS = 100;
constexpr double BUDGET_MS = 250.0;

FILE* out = nullptr;

void put(const std::string& key, const std::string& value) {
    std::fprintf(out, "%s: %s\n", key.c_str(), value.c_str());
    std::fflush(out);
}

void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
        std::exit(EXIT_CUDA_FAIL);
    }
}

struct Case {
    std::string spec;
    int size = 0;
    std::uint64_t seed = 0;
};

std::vector<Case> read_cases(const char* path) {
    std::ifstream f(path);
    std::vector<Case> cases;
    std::string line;
    const std::regex part(R"(\s*([a-zA-Z_]+):\s*([a-zA-Z]+|[+-]?[0-9]+)\s*)");
    while (std::getline(f, line)) {
        Case c;
        c.spec = line;
        std::size_t start = 0;
        while (true) {
            std::size_t end = line.find(';', start);
            std::string p = line.substr(start, end == std::string::npos ? std::string::npos : end - start);
            std::smatch m;
            if (!std::regex_match(p, m, part)) {
                std::fprintf(stderr, "invalid test case: '%s': '%s'\n", line.c_str(), p.c_str());
                std::exit(EXIT_TEST_SPEC);
            }
            if (m[1] == "size") c.size = std::stoi(m[2]);
            if (m[1] == "seed") c.seed = std::stoull(m[2]);
            if (end == std::string::npos) break;
            start = end + 1;
        }
        cases.push_back(c);
    }
    return cases;
}

struct Device {
    float *a = nullptr, *b = nullptr, *c = nullptr;
    int n = 0;
    explicit Device(int size) : n(size) {
        std::size_t bytes = sizeof(float) * static_cast<std::size_t>(std::max(size, 1));
        cuda_check(cudaMalloc(&a, bytes), "cudaMalloc");
        cuda_check(cudaMalloc(&b, bytes), "cudaMalloc");
        cuda_check(cudaMalloc(&c, bytes), "cudaMalloc");
    }
    ~Device() {
        cudaFree(a);
        cudaFree(b);
        cudaFree(c);
    }
};

// Runs the submission once on a case's input; "" when its output is right.
std::string run_and_check(const Case& c, std::uint64_t seed, Device& d) {
    std::vector<float> a, b;
    generate_input(c.size, seed, a, b);
    std::size_t bytes = sizeof(float) * a.size();
    cuda_check(cudaMemcpy(d.a, a.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda_check(cudaMemcpy(d.b, b.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda_check(cudaMemset(d.c, 0, bytes), "cudaMemset");
    custom_kernel(d.a, d.b, d.c, c.size);
    cuda_check(cudaGetLastError(), "custom_kernel");
    cuda_check(cudaDeviceSynchronize(), "custom_kernel");
    std::vector<float> got(a.size());
    cuda_check(cudaMemcpy(got.data(), d.c, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    std::vector<float> want = ref_kernel(a, b);
    for (std::size_t i = 0; i < want.size(); ++i) {
        if (got[i] != want[i]) {
            return "mismatch at index " + std::to_string(i) + ": expected " + std::to_string(want[i]) +
                   ", got " + std::to_string(got[i]);
        }
    }
    return "";
}

std::uint64_t ranked_seed(std::uint64_t seed, std::uint64_t secret) {
    return secret + (seed + secret) * (seed + secret + 1) / 2;
}

bool test(const std::vector<Case>& cases) {
    put("test-count", std::to_string(cases.size()));
    bool ok = true;
    for (std::size_t i = 0; i < cases.size(); ++i) {
        std::string k = "test." + std::to_string(i);
        put(k + ".spec", cases[i].spec);
        Device d(cases[i].size);
        std::string err = run_and_check(cases[i], cases[i].seed, d);
        put(k + ".status", err.empty() ? "pass" : "fail");
        if (!err.empty()) {
            put(k + ".error", err);
            ok = false;
        }
    }
    put("check", ok ? "pass" : "fail");
    return ok;
}

bool benchmark(const std::vector<Case>& cases, bool ranked) {
    const char* s = std::getenv("POPCORN_SEED");
    std::uint64_t secret = (ranked && s) ? std::stoull(s) : 0;
    put("benchmark-count", std::to_string(cases.size()));
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
    for (std::size_t i = 0; i < cases.size(); ++i) {
        std::string k = "benchmark." + std::to_string(i);
        put(k + ".spec", cases[i].spec);
        std::uint64_t seed = ranked ? ranked_seed(cases[i].seed, secret) : cases[i].seed;
        Device d(cases[i].size);
        std::string err = run_and_check(cases[i], seed, d);
        if (!err.empty()) {
            put(k + ".status", "fail");
            put(k + ".error", err);
            put("check", "fail");
            return false;
        }
        std::vector<double> ns;
        double spent_ms = 0;
        while (static_cast<int>(ns.size()) < MAX_RUNS && (static_cast<int>(ns.size()) < MIN_RUNS || spent_ms < BUDGET_MS)) {
            cuda_check(cudaEventRecord(start), "cudaEventRecord");
            custom_kernel(d.a, d.b, d.c, cases[i].size);
            cuda_check(cudaEventRecord(stop), "cudaEventRecord");
            cuda_check(cudaEventSynchronize(stop), "custom_kernel");
            float ms = 0;
            cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
            ns.push_back(ms * 1e6);
            spent_ms += ms;
        }
        double mean = std::accumulate(ns.begin(), ns.end(), 0.0) / ns.size();
        double var = 0;
        for (double x : ns) var += (x - mean) * (x - mean);
        double std_dev = ns.size() > 1 ? std::sqrt(var / (ns.size() - 1)) : 0.0;
        put(k + ".runs", std::to_string(ns.size()));
        put(k + ".mean", std::to_string(mean));
        put(k + ".std", std::to_string(std_dev));
        put(k + ".err", std::to_string(std_dev / std::sqrt(static_cast<double>(ns.size()))));
        put(k + ".best", std::to_string(*std::min_element(ns.begin(), ns.end())));
        put(k + ".worst", std::to_string(*std::max_element(ns.begin(), ns.end())));
    }
    put("check", "pass");
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    const char* fd = std::getenv("POPCORN_FD");
    if (fd == nullptr) return EXIT_PIPE_FAILED;
    if (argc < 3) {
        std::fprintf(stderr, "usage: eval.out test|benchmark|leaderboard|profile CASES_FILE\n");
        return 2;
    }
    out = fdopen(std::atoi(fd), "w");
    if (out == nullptr) return EXIT_PIPE_FAILED;
    std::string mode = argv[1];
    std::vector<Case> cases = read_cases(argv[2]);
    if (mode == "test") return test(cases) ? 0 : EXIT_VALIDATE_FAIL;
    if (mode == "benchmark" || mode == "profile") return benchmark(cases, false) ? 0 : EXIT_VALIDATE_FAIL;
    if (mode == "leaderboard") {
        benchmark(cases, true);
        return 0;
    }
    std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
    return 2;
}
