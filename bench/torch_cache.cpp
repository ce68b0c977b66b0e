/* A CPU allocator for PyTorch that keeps the blocks it is given back and hands the same block
 * out again for the next request of the same size: the torch peer's outputs then land on pages
 * already resident, so a timed call pays for its kernel, not for fresh pages (bench/README.md,
 * "Peers").  Built by bench/torch_cache.py at first use against the headers of the torch that
 * is imported, loaded with ctypes; the C functions below are its whole interface.
 *
 *   bnbw_keep_install()  make it torch's CPU allocator; 1 when torch now uses it
 *   bnbw_keep_remove()   give torch back the allocator it had (blocks made here stay valid:
 *                        each carries this file's deleter, which files it for reuse)
 *   bnbw_keep_flush()    free every block waiting for reuse
 *   bnbw_keep_counts(c)  c[0] blocks made fresh, c[1] blocks handed out again, c[2] blocks
 *                        waiting for reuse, c[3] their bytes
 */
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

std::mutex guard;
std::unordered_map<std::size_t, std::vector<void*>> waiting;   // size -> free blocks
std::unordered_map<void*, std::size_t> lent;                    // block -> size, in use
long long fresh = 0, reused = 0, waiting_blocks = 0, waiting_bytes = 0;
c10::Allocator* before = nullptr;

void give_back(void* block) {
    if (block == nullptr)
        return;
    std::lock_guard<std::mutex> hold(guard);
    auto found = lent.find(block);
    if (found == lent.end()) {       // not ours: cannot happen, but never leak or double-free
        c10::free_cpu(block);
        return;
    }
    waiting[found->second].push_back(block);
    waiting_blocks += 1;
    waiting_bytes += static_cast<long long>(found->second);
    lent.erase(found);
}

struct Keeping final : c10::Allocator {
    c10::DataPtr allocate(std::size_t n) override {
        const c10::Device cpu(c10::DeviceType::CPU);
        if (n == 0)
            return {nullptr, nullptr, &give_back, cpu};
        void* block = nullptr;
        {
            std::lock_guard<std::mutex> hold(guard);
            auto found = waiting.find(n);
            if (found != waiting.end() && !found->second.empty()) {
                block = found->second.back();
                found->second.pop_back();
                waiting_blocks -= 1;
                waiting_bytes -= static_cast<long long>(n);
                reused += 1;
            }
        }
        if (block == nullptr) {
            block = c10::alloc_cpu(n);
            std::lock_guard<std::mutex> hold(guard);
            fresh += 1;
        }
        std::lock_guard<std::mutex> hold(guard);
        lent[block] = n;
        return {block, block, &give_back, cpu};
    }

    c10::DeleterFnPtr raw_deleter() const override { return &give_back; }

    void copy_data(void* dest, const void* src, std::size_t count) const override {
        std::memcpy(dest, src, count);
    }
};

Keeping keeping;

}  // namespace

extern "C" {

int bnbw_keep_install(void) {
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != &keeping) {
        before = current;
        c10::SetCPUAllocator(&keeping);
    }
    return c10::GetCPUAllocator() == &keeping;
}

void bnbw_keep_remove(void) {
    if (before != nullptr && c10::GetCPUAllocator() == &keeping)
        c10::SetCPUAllocator(before);
}

void bnbw_keep_flush(void) {
    std::lock_guard<std::mutex> hold(guard);
    for (auto& entry : waiting)
        for (void* block : entry.second)
            c10::free_cpu(block);
    waiting.clear();
    waiting_blocks = 0;
    waiting_bytes = 0;
}

void bnbw_keep_counts(long long* counts) {
    std::lock_guard<std::mutex> hold(guard);
    counts[0] = fresh;
    counts[1] = reused;
    counts[2] = waiting_blocks;
    counts[3] = waiting_bytes;
}

}  // extern "C"
