// dspark: speculative decoding engine. Every failure a user can cause ends as
// one "error: ..." line on stderr and exit status 1 (2 for bad flags).
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"
#include "kernels/cpu/matmul.h"

int main(int argc, char** argv) {
  CLI::App app{"dspark: lossless speculative decoding with DSpark drafters"};
  app.require_subcommand(1);
  app.fallthrough();  // the flags below may follow the verb
  app.add_flag_callback(
      "--bf16-products", [] { dspark::cpu::set_bf16_products(true); },
      "CPU: multiply a bf16 checkpoint's weights with activations rounded to bf16, as HF transformers and the CUDA "
      "path do (faster, most of all on CPUs with AVX-512 BF16), instead of the f32 reference's f32 activations");
  dspark::cli::add_demo_command(app);
  dspark::cli::add_generate_command(app);
  dspark::cli::add_perplexity_command(app);
  dspark::cli::add_bench_command(app);
  dspark::cli::add_bench_train_command(*app.get_subcommand("bench"));
  dspark::cli::add_draft_init_command(app);
  dspark::cli::add_regen_command(app);
  dspark::cli::add_train_command(app);
  dspark::cli::add_calibrate_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const dspark::Error& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return 1;
  }
  return 0;
}
